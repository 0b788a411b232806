"""Process-level plumbing shared by every layer: allocator settings, logging, events."""

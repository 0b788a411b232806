"""`python -m noloco_node` is the same as the `noloco-node` console script."""

from noloco_node.cli.main import main

raise SystemExit(main())

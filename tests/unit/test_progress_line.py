"""`join`'s progress line on a terminal and the log lines around it: a log line clears the progress
line, takes a line of its own, and the progress line is drawn again under it (a newcomer saw
`... | loss 4.37810:01:41 INFO ...` glued together)."""

import io
import logging

from noloco_node.runtime.logging import ProgressLine, setup_logging


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_line_goes_above_the_progress_line_not_onto_it(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    setup_logging("INFO")
    line = ProgressLine(screen)
    try:
        line.update("step 12/100 | loss 4.378")
        logging.getLogger("noloco_node.test").info("round 26: solo step")
        line.update("step 13/100 | loss 4.301")
        line.close()
    finally:
        ProgressLine.shown = None
    shown = screen.getvalue()
    assert "loss 4.378\r\x1b[K" in shown  # cleared before the log line ...
    assert "round 26: solo step\nstep 12/100 | loss 4.378" in shown  # ... which ends its own line
    assert shown.endswith("step 13/100 | loss 4.301\n")
    logging.getLogger("noloco_node.test").info("after close")
    assert screen.getvalue().endswith("after close\n")


def test_off_a_terminal_there_is_no_progress_line_and_logs_are_plain(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    setup_logging("INFO")
    line = ProgressLine(out)
    line.update("step 1")
    logging.getLogger("noloco_node.test").info("plain")
    assert "step 1" not in out.getvalue() and out.getvalue().endswith("plain\n") and "\x1b" not in out.getvalue()


def test_asyncios_warning_of_a_daemon_we_reaped_ourselves_is_not_shown(capsys):
    import logging

    from noloco_node.runtime.logging import setup_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    setup_logging("INFO")
    try:
        logging.getLogger("asyncio").warning("Unknown child process pid %d, will report returncode 255", 3730)
        logging.getLogger("asyncio").warning("something else")
    finally:
        root.handlers[:], root.level = handlers, level
    err = capsys.readouterr().err
    assert "Unknown child process" not in err and "something else" in err


def test_a_cleared_line_leaves_nothing_behind_and_is_drawn_again_by_the_next_update():
    screen = Terminal()
    line = ProgressLine(screen)
    try:
        line.update("starting the swarm: 1/4 nodes up")
        line.clear()
        assert ProgressLine.shown is None  # a log line now prints plainly
        assert screen.getvalue() == "\r\x1b[Kstarting the swarm: 1/4 nodes up\r\x1b[K"
        line.update("inner steps 3/40")
        line.close()
    finally:
        ProgressLine.shown = None
    assert screen.getvalue().endswith("\r\x1b[K\r\x1b[Kinner steps 3/40\n")

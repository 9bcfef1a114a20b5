"""``python -m molt_with_ctrl_c fit ...``: ``molt`` with Python's Ctrl-C handling restored. A shell starts a background
job with SIGINT ignored, and Python (and every process it starts) keeps an ignored SIGINT, so a suite run from a
background job would otherwise send the reliability tests' SIGINT to a process that ignores it."""

import runpy
import signal

if __name__ == "__main__":  # vLLM's engine core starts with spawn and imports this module again: run molt once
    signal.signal(signal.SIGINT, signal.default_int_handler)
    runpy.run_module("molt_lightning.commands.cli", run_name="__main__", alter_sys=True)

"""The lab's one way to the chain: a tool imports this before the scripts and common.py.

A tool runs as `python lab/<tool>.py` (this folder first on sys.path) or is imported by the lab's tests; either way
the chain lives one folder up, at the repository's root, and never imports the lab."""
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parent
ROOT = LAB.parent  # the repository's root: the scripts, common.py, machine.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

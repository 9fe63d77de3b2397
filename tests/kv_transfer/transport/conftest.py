"""Make this directory's helper modules importable by name, also in spawned child processes
(multiprocessing's spawn start method ships the parent's sys.path to the child)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

"""python -m orchestrator: the same as `tandem orchestrator`."""

import sys

from tandem.cli import main

main(["orchestrator", *sys.argv[1:]])

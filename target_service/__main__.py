"""python -m target_service: the same as `tandem target-service`."""

import sys

from tandem.cli import main

main(["target-service", *sys.argv[1:]])

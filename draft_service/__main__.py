"""python -m draft_service: the same as `tandem draft-service`."""

import sys

from tandem.cli import main

main(["draft-service", *sys.argv[1:]])

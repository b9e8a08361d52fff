import sys

from syncless.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))

import sys

try:  # a Ctrl-C while the command line's modules are still importing is one line too
    from dtpshard.cli import main
except KeyboardInterrupt:
    print("dtpshard: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())

"""`python -m vaecache`: the same entry point as the `vaecache` console script."""

try:
    from vaecache.cli.app import main
except KeyboardInterrupt:  # Ctrl-C while the CLI itself imports: one line, not an import traceback
    import sys

    sys.stderr.write("interrupted during start-up; nothing was written\n")
    from vaecache.errors import EXIT_INTERRUPTED

    sys.exit(EXIT_INTERRUPTED)

if __name__ == "__main__":
    main()

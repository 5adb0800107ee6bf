import sys

from lightning_gaudi_fsdp.cli import main

if __name__ == "__main__":  # not when a documentation tool imports every module of the package
    sys.exit(main())

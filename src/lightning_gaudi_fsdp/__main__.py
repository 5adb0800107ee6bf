import sys

from lightning_gaudi_fsdp.cli import main

sys.exit(main())

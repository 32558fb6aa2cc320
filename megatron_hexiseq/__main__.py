import sys

from megatron_hexiseq.cli import main

sys.exit(main())

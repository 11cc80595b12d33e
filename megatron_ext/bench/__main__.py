import sys

from megatron_ext.bench.cli import main

sys.exit(main())

import sys

from csi_local.cli import main

sys.exit(main())

import sys

from kvmetrics.cli.main import main

sys.exit(main())

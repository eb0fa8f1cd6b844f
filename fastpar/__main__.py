import sys

from fastpar.cli import main

sys.exit(main())

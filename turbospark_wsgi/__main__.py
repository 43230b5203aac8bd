"""`python -m turbospark_wsgi` is the `turbospark` command."""
import sys

from .cli import main

sys.exit(main())

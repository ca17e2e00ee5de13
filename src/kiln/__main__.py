import os
import sys

# As the installed `kiln` script (and `python -P`): the working folder is not on the import path, so a
# MODULE:FACTORY reference (--torch, --metric) never imports a file that merely lies in the current directory.
# (Python itself has already imported kiln's own dependencies by the time this runs.)
if sys.path and not sys.flags.safe_path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

from .cli import main  # after the import path is fixed

sys.exit(main())

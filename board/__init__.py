"""weftboard.board: the board service, its client and the blob stores.

Importing it gives the library's quiet logging default (``logs.library_defaults``): nothing is
printed unless the host configures ``logging`` (or structlog) itself.
"""

from weftboard.board.logs import library_defaults

library_defaults()

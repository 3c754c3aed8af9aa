"""Imported first by the grammar pool's fork server (engine/structured/pool.py): the fork server, and every
compiler process forked from it, ignore SIGTERM and SIGINT.

Both reach the whole process group (`docker stop`, systemd, a terminal's Ctrl-C). The server leads the
shutdown: it drains requests, then closes its compiler processes' pipes (they end) and exits, which ends the
fork server. A fork server killed by the group's SIGTERM first would make the pool's next start fail with a
traceback in the middle of an orderly stop.

Never import this module in the server's own process.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)

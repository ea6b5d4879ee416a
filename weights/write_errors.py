"""The OS error number behind a failed write, wherever it was raised: an OSError, or TensorStore's
ValueError under Orbax (a full disk during a conversion or a training checkpoint's save)."""

from __future__ import annotations

import errno
import re


def write_error_number(error: BaseException | None) -> int | None:
    """The OS error number of a failed write: an OSError's, or the one TensorStore (under Orbax)
    carries in its ValueError's text (`os_error_code='27'`), on the error or an error it was raised
    from (Orbax re-raises its writer threads' errors); None for any other error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            return error.errno or errno.EIO
        code = re.search(r"os_error_code='?(\d+)", str(error))
        if code:
            return int(code.group(1))
        # the error it was raised from; the one being handled only when not suppressed (`from None`)
        error = error.__cause__ if error.__cause__ is not None or error.__suppress_context__ else error.__context__
    return None

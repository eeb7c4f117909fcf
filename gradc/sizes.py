"""Byte sizes as users write them (--memory-budget 64MiB) and as messages show them."""
import math
import re

UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
MAX_BYTES = 2**63 - 1   # what an int64 byte count holds; the planners and numpy count in int64


def parse_size(text):
    """'auto' (any case), an int, or text like '512', '1,048,576', '1.5GiB', '200MB' -> 'auto' or whole
    bytes (a unit's fraction rounded down); ValueError otherwise (also for negative, non-finite, over-int64 sizes, those between 0 and 1 byte and
    a fraction of a byte written without a unit, '1000.7')."""
    usage = f"{text!r} is not a size (bytes, or with KiB/MiB/GiB or KB/MB/GB)"
    if isinstance(text, bool):
        raise ValueError(usage)
    if isinstance(text, int):
        value = text
    elif str(text).strip().lower() == "auto":
        return "auto"
    else:
        t = str(text).strip().upper().replace(" ", "")
        word = next((w for w in ("BYTES", "BYTE") if t.endswith(w)), "")   # ('1,130,816 bytes', as printed)
        t = t[:len(t) - len(word)]
        num = t.rstrip("KMGIB")
        unit = t[len(num):] if not word else "?" if t != num else ""
        if re.fullmatch(r"[1-9]\d{0,2}(,\d{3})+(\.\d*)?", num):   # (as messages print counts: 1,130,816 bytes)
            num = num.replace(",", "")
        try:
            value = float(num) * UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(usage) from None
        if not math.isfinite(value):
            raise ValueError(f"{text!r} is not a size: it is not finite")
        if UNITS[unit] == 1 and value != int(value):   # (1.3KiB is 1331.2: a unit's fraction is rounded down)
            raise ValueError(f"{text!r} is not a size: a count of bytes is a whole number")
    if value < 0:
        raise ValueError(f"{text!r} is not a size: it is negative")
    if 0 < value < 1:   # (a larger fraction is rounded down to whole bytes: a bound stays a bound)
        raise ValueError(f"{text!r} is not a size: it is less than one byte")
    if value > MAX_BYTES:
        raise ValueError(f"{text!r} is not a size: it is more than {MAX_BYTES:,} bytes")
    return int(value)


def format_size(n):
    """'1.50 MiB (1,572,864 bytes)'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,} bytes)"
    return "1 byte" if n == 1 else f"{n:,} bytes"

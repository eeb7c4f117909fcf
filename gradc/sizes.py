"""Byte sizes as users write them (--memory-budget 64MiB) and as messages show them."""

UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text):
    """'auto', an int, or text like '512', '1.5GiB', '200MB' -> 'auto' or bytes; ValueError otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size (bytes, or with KiB/MiB/GiB)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text!r} is not a size: it is negative")
        return text
    if text == "auto":
        return "auto"
    t = str(text).strip().upper().replace(" ", "")
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (bytes, or with KiB/MiB/GiB)") from None
    if unit not in UNITS or not value >= 0:
        raise ValueError(f"{text!r} is not a size (bytes, or with KiB/MiB/GiB)")
    return int(value * UNITS[unit])


def format_size(n):
    """'1.50 MiB (1,572,864 bytes)'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"

"""The work array of a scan's step: where each of its intermediates starts, as short source.

A step's intermediates lie one after another in one flat array. Their offsets are sums of the
sizes before them; summed term by term (`1664*d_B + 512`, not `(d_B*512) + (d_B*512) + ...`), the
generated step reads as a layout and Numba types a short expression per view.
"""


class WorkSizes:
    """Sizes of the buffers laid out so far, as a polynomial in the dims' variables."""

    def __init__(self):
        self.terms = {}   # the dim variables of a monomial (sorted) -> its integer coefficient

    def add(self, shape, dims):
        """Lay out one buffer of `shape` (ints and dim names; dims maps a name to its variable)."""
        coefficient, variables = 1, []
        for d in shape:
            if isinstance(d, str):
                variables.append(dims[d])
            else:
                coefficient *= int(d)
        key = tuple(sorted(variables))
        self.terms[key] = self.terms.get(key, 0) + coefficient

    def source(self):
        """The total so far as a Python expression ("0" when nothing is laid out)."""
        parts = []
        for variables, coefficient in sorted(self.terms.items(), key=lambda kv: (-len(kv[0]), kv[0])):
            if coefficient == 0:
                continue
            factors = ([str(coefficient)] if coefficient != 1 or not variables else []) + list(variables)
            parts.append("*".join(factors))
        return " + ".join(parts) or "0"

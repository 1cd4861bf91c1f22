"""View and laterality names as the loaders and the view pairing understand them.

A module of its own so that datasets/common.py and pairing.py both import it at the top
without importing each other.
"""

# (choice) ML/LM/LMO are lateral views and pair with CC like an MLO; exaggerated CCs are CCs.
_VIEWS = {"CC": "CC", "XCCL": "CC", "XCCM": "CC", "MLO": "MLO", "ML": "MLO", "LM": "MLO",
          "LMO": "MLO"}
_LATERALITIES = {"L": "L", "LEFT": "L", "R": "R", "RIGHT": "R"}


def normalize_view(view):
    """'CC'/'MLO' (ML/LM/LMO -> MLO), or None when not a CC/MLO-like view."""
    return _VIEWS.get(str(view).strip().upper())


def normalize_laterality(lat):
    """'L'/'R' from L/R/LEFT/RIGHT, or None."""
    return _LATERALITIES.get(str(lat).strip().upper())

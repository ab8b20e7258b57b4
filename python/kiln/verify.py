"""Numerical checks of a ``.kiln`` model, as ``kiln-verify`` runs them."""

from ._kiln import verify_layers as _verify_layers

__all__ = ["layers"]


def layers(model, reference, **kw):
    """Compare every activation of ``model`` with a reference dump, in forward order.

    What ``kiln-verify layers MODEL --reference REFERENCE`` does, with its flags as keywords:
    ``max_nmse``, ``min_top1``, ``tolerance`` (a class name: f32, f16, bf16, q8_0, q4_0,
    q3_k, q2_k), ``threads``, ``junit`` and ``report`` (paths of results files to write too).

    Returns the report ``--json`` prints, as a dict: ``pass`` is False when an activation is
    out of tolerance (a result, not an exception; ``first_failure`` names the first), and
    ``entries`` lists each activation's ``name``, ``shape``, ``max_abs``, ``rms``, ``rel``,
    ``cosine``, ``nmse``, ``top1`` (logits only) and ``pass``, judged by ``tolerance``
    (``max_nmse``, ``min_top1``).

    Raises ``kiln.KilnError`` when the check cannot run (a missing or corrupt model or dump),
    with the command line's message, and ``kiln.InvalidRequestError`` for a bad keyword value.
    """
    return _verify_layers(model, reference, **kw)

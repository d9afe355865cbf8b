"""The SP group's libraries' own notices stay off the user's console (`spotlight profile`
printed torch's FutureWarning about diffusers' all_gather_tensor call, and diffusers' note
that enable_parallelism is experimental, at every SP group)."""

from __future__ import annotations

import logging
import warnings

from spotlight.workers.sp.group import hide_library_notices

# torch 2.13's text (torch/distributed/_functional_collectives.py)
DEPRECATED = (
    "`torch.distributed._functional_collectives.all_gather_tensor` is deprecated. "
    "Please use `torch.distributed._functional_collectives.all_gather_single` instead."
)


def test_diffusers_context_parallel_notices_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_library_notices()
        warnings.warn(DEPRECATED, FutureWarning)
        warnings.warn("another FutureWarning stays visible", FutureWarning)
    assert [str(w.message) for w in caught] == ["another FutureWarning stays visible"]
    hide_library_notices()  # twice: one logging filter, not two
    logger = logging.getLogger("diffusers.models.modeling_utils")
    assert sum(getattr(f, "__name__", "") == "_not_experimental_note" for f in logger.filters) == 1
    note = logger.makeRecord(
        logger.name,
        logging.WARNING,
        __file__,
        1,
        "`enable_parallelism` is an experimental feature. The API …",
        None,
        None,
    )
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "something else", None, None)
    assert not logger.filter(note) and logger.filter(other)

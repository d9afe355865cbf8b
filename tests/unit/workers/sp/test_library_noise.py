"""The SP group's libraries' own notices stay off the user's console (`spotlight profile`
printed torch's FutureWarning about diffusers' all_gather_tensor call, and diffusers' note
that enable_parallelism is experimental, at every SP group)."""

from __future__ import annotations

import logging
import warnings


def test_diffusers_context_parallel_notices_are_filtered():
    import spotlight.workers.sp.group  # noqa: F401  (installs the filters)

    deprecated = "`torch.distributed._functional_collectives.all_gather_tensor` is deprecated. Please use …"
    ignored = [
        f for f in warnings.filters if f[0] == "ignore" and f[2] is FutureWarning and f[1] and f[1].match(deprecated)
    ]
    assert ignored, "group.py's FutureWarning filter is not installed"
    logger = logging.getLogger("diffusers.models.modeling_utils")
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

"""Degree-invariant Ulysses (spotlight/workers/sp/invariant.py): the keys a rank's attention
kernel sees after the all-to-all are put in one worker's order, padded text keys left out, and
only inside the SP group's velocity without autograd. The group-level proof (SP 2 → 1 → 2 equal
to one worker bit for bit) is tests/unit/workers/sp/test_group_families.py."""

from __future__ import annotations

import pytest
import torch

from spotlight.workers.sp import invariant


def _ulysses_order(text: torch.Tensor, image: torch.Tensor, degree: int) -> torch.Tensor:
    """The sequence a rank holds after Ulysses' all-to-all: ``[t_0, i_0, t_1, i_1, …]``."""
    return torch.cat([p for r in zip(text.chunk(degree, 1), image.chunk(degree, 1)) for p in r], 1)


@pytest.mark.parametrize("degree", [2, 4])
def test_canonical_order_restores_one_workers_key_order(degree):
    text = torch.arange(8).reshape(1, 8)
    image = 100 + torch.arange(16).reshape(1, 16)
    gathered = _ulysses_order(text, image, degree)
    assert not torch.equal(gathered, torch.cat([text, image], 1))
    assert torch.equal(invariant.canonical_order(gathered, 8 // degree, degree, dim=1), torch.cat([text, image], 1))


def test_canonical_order_drops_the_padded_text_tokens():
    text = torch.tensor([[1, 2, 3, -1]])  # 3 real tokens padded to 4 for SP 2
    image = torch.tensor([[10, 11, 12, 13]])
    out = invariant.canonical_order(_ulysses_order(text, image, 2), 2, 2, dim=-1, text_pad=1)
    assert out.tolist() == [[1, 2, 3, 10, 11, 12, 13]]


def test_canonical_order_refuses_shapes_that_are_not_degree_blocks():
    x = torch.zeros(1, 7)
    with pytest.raises(ValueError, match="equal blocks"):
        invariant.canonical_order(x, 1, 2, dim=1)
    with pytest.raises(ValueError, match="do not fit"):
        invariant.canonical_order(torch.zeros(1, 8), 5, 2, dim=1)
    with pytest.raises(ValueError, match="padding tokens"):
        invariant.canonical_order(torch.zeros(1, 8), 1, 2, dim=1, text_pad=3)
    with pytest.raises(ValueError, match="do not split"):
        with invariant.joint_key_order(7, 2):
            pass


def _qkv(seq: int, heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, seq, heads, dim, generator=g) for _ in range(3)]


def test_wrapped_attention_op_sees_one_workers_keys_only_inside_the_context():
    """Diffusers' native op (what Ulysses calls after its all-to-all) with keys in Ulysses order:
    inside ``joint_key_order`` and without autograd it computes exactly one worker's attention
    (keys in ``[text; image]`` order, padded keys left out); elsewhere it is untouched."""
    assert invariant.install() and invariant.install()  # idempotent
    from diffusers.models import attention_dispatch as ad

    text_real, text, image, degree = 3, 4, 8, 2
    q, k, v = _qkv(text + image)
    mask = torch.ones(2, 1, 1, text + image, dtype=torch.bool)
    mask[:, ..., text_real:text] = False  # the padded text token
    mask[1, ..., 1] = False  # a masked real token
    keys = [x[:, :text_real].clone() for x in (k, v)]
    keys = [torch.cat([x, torch.zeros(2, 1, *x.shape[2:])], 1) for x in keys]  # padded text (zeros)
    k_text, v_text = keys
    k_img, v_img = k[:, text:], v[:, text:]
    m_text, m_img = mask[..., :text], mask[..., text:]
    k_u, v_u = (_ulysses_order(t, i, degree) for t, i in ((k_text, k_img), (v_text, v_img)))
    m_u = _ulysses_order(m_text.flatten(0, 2), m_img.flatten(0, 2), degree).reshape(2, 1, 1, -1)

    def one_worker():  # [text without padding; image], the mask to match
        kk, vv = torch.cat([k_text[:, :text_real], k_img], 1), torch.cat([v_text[:, :text_real], v_img], 1)
        mm = torch.cat([m_text[..., :text_real], m_img], -1)
        return torch.nn.functional.scaled_dot_product_attention(
            *(x.permute(0, 2, 1, 3) for x in (q, kk, vv)), attn_mask=mm
        ).permute(0, 2, 1, 3)

    with torch.no_grad():
        with invariant.joint_key_order(text, degree, text - text_real):
            inside = ad._native_attention_forward_op(None, q, k_u, v_u, m_u, _save_ctx=False)
        outside = ad._native_attention_forward_op(None, q, k_u, v_u, m_u, _save_ctx=False)
    assert torch.equal(inside, one_worker())
    torch.testing.assert_close(outside, inside)  # Ulysses' own order: the same attention up to rounding
    with torch.enable_grad(), invariant.joint_key_order(text, degree, text - text_real), torch.no_grad():
        # diffusers calls the op inside an autograd Function's forward, where grad is always off:
        # what counts is the grad state where the context was entered (Ulysses' backward needs
        # its own key order)
        graded = ad._native_attention_forward_op(None, q, k_u, v_u, m_u, _save_ctx=False)
    assert torch.equal(graded, outside)  # with autograd (never a rollout): diffusers' op untouched
    with torch.no_grad(), invariant.joint_key_order(text, degree, text - text_real):
        with pytest.raises(ValueError, match="key mask of"):
            ad._native_attention_forward_op(None, q, k_u, v_u, m_u[..., 1:], _save_ctx=False)
    with torch.no_grad(), invariant.joint_key_order(text, degree, 1), pytest.raises(ValueError, match="key mask"):
        ad._native_attention_forward_op(None, q, k_u, v_u, None, _save_ctx=False)

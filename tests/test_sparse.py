"""The sparse codec (SparseLoCo's chunk-wise top-k with 2-bit values), the support codec its reducers send averages
back with, and error feedback's decay: what each keeps, what its bounds promise, and what its decoders refuse.
(The generic codec tests of test_compression.py run on `sparse` too.)"""

from __future__ import annotations

import pytest
import torch

from swarm.compression import CodecError, ErrorFeedback, FragmentFeedback, decode, get_codec
from swarm.compression.sparse import SparseCodec, SupportCodec
from swarm.compression.wire import decode_header

pytestmark = pytest.mark.timeout(60)


def _gaussian(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def test_sparse_keeps_the_largest_of_every_chunk_as_sign_and_one_of_two_magnitudes():
    codec = SparseCodec(per_chunk=8, chunk=64)
    tensor = _gaussian(3 * 64 + 10)  # three whole chunks and a tail of 10, which keeps ceil(10 * 8 / 64) = 2
    restored = codec.decode(codec.encode(tensor))
    assert codec.kept_count(tensor.numel()) == 3 * 8 + 2
    kept = restored.nonzero().squeeze(1)
    expected = torch.cat([torch.topk(tensor[a:a + 64].abs(), 8).indices.sort().values + a for a in (0, 64, 128)]
                         + [torch.topk(tensor[192:].abs(), 2).indices.sort().values + 192])
    assert torch.equal(kept, expected)
    assert torch.equal(restored[kept].sign(), tensor[kept].sign())
    for a in (0, 64, 128):  # the two magnitudes: the means of the chunk's lower and upper half of kept magnitudes
        magnitudes = tensor[a:a + 64].abs().topk(8).values.sort().values
        low, high = float(magnitudes[:4].mean()), float(magnitudes[4:].mean())
        sent = sorted(set(restored[a:a + 64].abs()[restored[a:a + 64] != 0].tolist()))
        assert sent == [pytest.approx(low), pytest.approx(high)]


def test_sparse_sends_a_sixty_fourth_at_about_a_fiftieth_of_a_byte_a_parameter():
    codec, tensor = get_codec("sparse"), _gaussian(1 << 20, seed=1)
    payload = codec.encode(tensor)
    assert codec.kept_count(tensor.numel()) == tensor.numel() // 64
    assert len(payload) / tensor.numel() <= codec.bytes_per_param(tensor.numel()) <= 0.04
    assert len(payload) / tensor.numel() < 0.025  # (spread positions: most gaps take one byte)
    restored = codec.decode(payload)
    kept = restored != 0
    assert float((tensor - restored)[kept].norm() / tensor[kept].norm()) < 0.1  # 2 bits on the kept values


def test_sparse_decoder_refuses_a_payload_of_another_density_or_chunk_with_one_line():
    tensor = _gaussian(10_000, seed=2)
    for other in (SparseCodec(per_chunk=32), SparseCodec(per_chunk=64, chunk=2048)):
        with pytest.raises(CodecError, match="this run's codec keeps") as caught:
            get_codec("sparse").decode(other.encode(tensor))
        assert "\n" not in str(caught.value)
    with pytest.raises(CodecError, match="per_chunk"):
        SparseCodec(per_chunk=0)
    with pytest.raises(CodecError, match="block_size"):
        SparseCodec(chunk=8192)


def test_the_average_of_sparse_contributions_comes_back_with_every_position_it_has():
    codec = get_codec("sparse")
    parts = [codec.decode(codec.encode(_gaussian(200_000, seed=seed))) for seed in range(4)]
    average = sum(parts) / 4
    back = codec.average_codec(4)
    assert isinstance(back, SupportCodec) and back.members == 4 and get_codec("int8").average_codec(4).name == "int8"
    payload = back.encode(average)
    restored = decode(payload)  # (the header names `support`: any member decodes it)
    assert decode_header(payload).codec == "support"
    assert torch.equal(restored.nonzero(), average.nonzero())
    assert bool(((restored - average).abs() <= back.error_bound(average)).all())
    # The members' check reads the rounding off what they decoded: at least the rounding there was.
    assert back.error_bound_norm(restored) >= float((restored - average).norm())
    assert len(payload) / average.numel() < 0.25  # about a sixteenth kept, 1 byte of gap and 2 of value each
    zero = back.encode(torch.zeros(1000))
    assert torch.equal(back.decode(zero), torch.zeros(1000)) and decode_header(zero).aux == 1


def test_the_support_codec_refuses_more_positions_than_its_members_can_have():
    one = SupportCodec(members=1)
    dense = _gaussian(8192, seed=3)
    with pytest.raises(CodecError, match="more than the 128"):
        one.encode(dense)
    with pytest.raises(CodecError, match="keeps 8192 of 8192") as caught:
        one.decode(SupportCodec().encode(dense))  # (as many as 4096 members: all of them)
    assert "\n" not in str(caught.value)
    payload = SupportCodec().encode(dense)
    for length in (0, 31, len(payload) - 1):
        with pytest.raises(CodecError):
            SupportCodec().decode(payload[:length])


def test_error_feedback_decays_what_it_carries_by_the_codec_s_factor():
    codec = get_codec("sparse")
    assert codec.feedback_decay == 0.95 and get_codec("int8").feedback_decay == 1.0
    feedback = ErrorFeedback(True, codec.feedback_decay)
    first = torch.tensor([4.0, 1.0, 0.0, 0.0])
    feedback.update(first, torch.tensor([4.0, 0.0, 0.0, 0.0]))  # 1.0 was not delivered
    to_send = feedback.compensate(torch.tensor([0.0, 0.0, 2.0, 0.0]))
    assert torch.equal(to_send, torch.tensor([0.0, 0.95, 2.0, 0.0]))
    fragments = FragmentFeedback.for_codec([4, 4], "sparse")
    assert [part.decay for part in fragments.parts] == [0.95, 0.95]
    assert FragmentFeedback.for_codec([4], "fp16").parts[0].enabled is False

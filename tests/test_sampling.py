"""Greedy picking: numpy's argmax on a CPU gives torch's answer, the first of tied maxima included."""
import pytest
import torch

from cabinllm.runtime.generation.sampling import SamplingParams, greedy, make_generator, sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the dtypes numpy picks
def test_greedy_equals_torch_argmax(dtype):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(49152, generator=generator).to(dtype)
        assert greedy(logits) == int(torch.argmax(logits))


def test_greedy_takes_the_first_of_tied_maxima_and_skips_masked_tokens():
    logits = torch.tensor([1.0, 3.0, float("-inf"), 3.0, 2.0])
    assert greedy(logits) == 1
    assert greedy(logits.masked_fill(torch.tensor([False, True, False, False, False]), float("-inf"))) == 3
    assert sample(logits, SamplingParams(temperature=0), make_generator(0)) == 1


def test_greedy_reads_a_row_of_a_batch():
    batch = torch.tensor([[0.0, 5.0, 1.0], [7.0, 0.0, 1.0]])
    assert [greedy(row) for row in batch] == [1, 0]

"""What a forward takes, on its own (pytest_attncost.inputs): build() for default and user inputs,
token_shape and read_lengths on a hand-built Split, fresh() copies, and the bytes a cache holds."""

import pytest
import torch
from torch import nn

from pytest_attncost.errors import ProfileError
from pytest_attncost.families import INPUTS_HINT
from pytest_attncost.inputs import Built, Ran, build, cache_bytes, fresh, read_lengths, token_shape
from pytest_attncost.parts import Split
from pytest_attncost.request import Request

WIDTH = 64


def tiny_bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=128, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128))


def encoder(batch_first=True):
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 128, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class Plain(nn.Module):
    """A model of no known family: its inputs' layout cannot be told."""

    def forward(self, x, mask=None):
        return x


def _is_meta_copy(copy, original):
    return (copy is not original and copy.device.type == "meta" and copy.shape == original.shape
            and copy.dtype == original.dtype)


# --- build(): default inputs ---------------------------------------------------------------------


def test_default_inputs_of_a_bert_are_token_ids_on_meta():
    built = build(tiny_bert(), Request(16, 2))
    assert (built.args, built.given, built.decoding) == ((), None, False)
    ids = built.kwargs["input_ids"]
    assert (tuple(ids.shape), ids.dtype, ids.device.type) == ((2, 16), torch.int64, "meta")
    assert all(t.device.type == "meta" for t in built.kwargs.values() if isinstance(t, torch.Tensor))
    assert built.call() == (built.args, built.kwargs)  # not decoding: the same inputs for every count
    assert built.real_call() is None  # nothing of the user's to run on real tensors


def test_default_inputs_of_torch_modules_follow_their_layout():
    first = build(encoder(batch_first=True), Request(16, 2)).args[0]
    second = build(encoder(batch_first=False), Request(16, 2)).args[0]
    assert (tuple(first.shape), first.device.type) == ((2, 16, WIDTH), "meta")
    assert tuple(second.shape) == (16, 2, WIDTH)


# --- build(): the user's inputs, kept with their values ---------------------------------------------


def test_a_tuple_is_kept_and_copied_to_meta():
    x, mask = torch.ones(2, 8, WIDTH), torch.ones(2, 8, dtype=torch.bool)
    built = build(Plain(), Request(None, 1, inputs=(x, mask)))
    assert built.given == ((x, mask), {})
    assert built.given[0][0] is x and built.given[0][1] is mask  # the values, for the real-tensor fallback
    assert all(_is_meta_copy(copy, original) for copy, original in zip(built.args, (x, mask)))
    assert built.kwargs == {}
    assert built.real_call() is built.given


def test_a_list_is_taken_as_positional_arguments():
    x = torch.ones(1, 4, WIDTH)
    built = build(Plain(), Request(None, 1, inputs=[x]))
    assert built.given == ((x,), {}) and _is_meta_copy(built.args[0], x)


def test_a_dict_is_keyword_arguments():
    ids = torch.ones(3, 12, dtype=torch.long)
    built = build(tiny_bert(), Request(None, 1, inputs={"input_ids": ids, "output_attentions": False}))
    assert built.given == ((), {"input_ids": ids, "output_attentions": False})
    assert built.given[1]["input_ids"] is ids
    assert built.args == () and _is_meta_copy(built.kwargs["input_ids"], ids)
    assert built.kwargs["output_attentions"] is False  # not a tensor: kept as it is


def test_a_tensor_is_the_one_positional_argument():
    x = torch.ones(2, 5, WIDTH)
    built = build(Plain(), Request(None, 1, inputs=x))
    assert built.given[0][0] is x and built.given[1] == {}
    assert len(built.args) == 1 and _is_meta_copy(built.args[0], x)


def test_a_callable_is_called_with_n_and_batch():
    calls = []

    def inputs(n, batch):
        calls.append((n, batch))
        return (torch.full((batch, n, WIDTH), 2.0),)

    built = build(Plain(), Request(5, 3, inputs=inputs))
    assert calls == [(5, 3)]  # once
    (x,), kwargs = built.given
    assert kwargs == {} and tuple(x.shape) == (3, 5, WIDTH) and bool((x == 2).all())  # the values it made
    assert _is_meta_copy(built.args[0], x)


@pytest.mark.parametrize(
    ("n", "inputs", "message"),
    [
        (16, 3.5, f"inputs= got float; {INPUTS_HINT}"),
        (16, nn.Linear(2, 2), f"inputs= got Linear; {INPUTS_HINT}"),  # a module is not a callable of (n, batch)
        (16, lambda n, batch: 7, f"inputs= got int; {INPUTS_HINT}"),  # what a callable returns is checked alike
        (16, {0: torch.zeros(1)}, "an inputs= dict maps keyword-argument names (str) to values"),
        (None, lambda n, batch: (torch.zeros(batch, n),),
         "inputs= is a callable (n, batch) -> ..., so n is needed: pass n= (or mark the test)"),
    ],
)
def test_bad_inputs_are_a_profile_error(n, inputs, message):
    with pytest.raises(ProfileError) as caught:
        build(Plain(), Request(n, 1, inputs=inputs))
    assert str(caught.value) == message


def test_a_callable_that_raises_is_named():
    def inputs(n, batch):
        raise RuntimeError("no such device")

    with pytest.raises(ProfileError) as caught:
        build(Plain(), Request(16, 2, inputs=inputs))
    assert str(caught.value) == "inputs(n=16, batch=2) raised RuntimeError: no such device"
    assert isinstance(caught.value.__cause__, RuntimeError)


# --- token_shape: (batch, n) of the main input, where it can be told ------------------------------------


def test_token_shape():
    bert, ids = tiny_bert(), torch.zeros(2, 16, dtype=torch.long)
    assert token_shape(bert, (), {"input_ids": ids}) == (2, 16)
    assert token_shape(bert, (ids,), {}) == (2, 16)  # the first integer tensor
    # the main input first, whatever comes before it
    assert token_shape(bert, (torch.zeros(5, 3, dtype=torch.long),), {"input_ids": ids}) == (2, 16)
    assert token_shape(Plain(), (torch.ones(2, 16, dtype=torch.bool),), {}) is None  # a mask is not token ids
    assert token_shape(Plain(), (torch.zeros(2, 16, WIDTH),), {}) is None  # floats of an unknown layout
    assert token_shape(encoder(batch_first=True), (torch.zeros(2, 16, WIDTH),), {}) == (2, 16)
    assert token_shape(encoder(batch_first=False), (torch.zeros(16, 2, WIDTH),), {}) == (2, 16)


# --- read_lengths: n and batch read back, on a hand-built Split -----------------------------------------


def _lengths(model, inputs, n=None, batch=1, batch_given=False, split=None):
    request = Request(n, batch, batch_given, inputs=inputs)
    return read_lengths(Ran(model, build(model, request), None, split or Split()), request)


def test_default_inputs_were_built_for_n():
    bert = tiny_bert()
    built = build(bert, Request(16, 2))
    # whatever the attention saw: the inputs were made for n and batch
    assert read_lengths(Ran(bert, built, None, Split(lengths=[(9, 9, 4)])), Request(16, 2, True)) == (16, 2)


def test_n_and_batch_are_read_back_from_token_ids():
    ids = torch.zeros(3, 24, dtype=torch.long)
    assert _lengths(tiny_bert(), {"input_ids": ids}) == (24, 3)
    assert _lengths(tiny_bert(), {"input_ids": ids}, n=24, batch=3, batch_given=True) == (24, 3)


def test_n_that_disagrees_with_the_inputs_names_both_numbers():
    ids = torch.zeros(1, 24, dtype=torch.long)
    with pytest.raises(ProfileError) as caught:
        _lengths(tiny_bert(), {"input_ids": ids}, n=32)
    assert str(caught.value) == ("n=32 was asked for, but the attention saw 24 tokens; "
                                 "drop n= to use the inputs' length, or make the inputs match")


def test_batch_that_disagrees_with_the_inputs_names_both_numbers():
    ids = torch.zeros(2, 24, dtype=torch.long)
    with pytest.raises(ProfileError) as caught:
        _lengths(tiny_bert(), {"input_ids": ids}, batch=3, batch_given=True)
    assert str(caught.value) == "batch=3 was asked for, but the inputs hold a batch of 2"


def test_without_token_ids_the_queries_the_attention_saw_decide():
    x = torch.zeros(2, 10, WIDTH)
    # (queries, keys, batch x heads) per core group: most saw 10 queries; batch 2 from the inputs (b, n, ...)
    split = Split(lengths=[(10, 10, 4), (7, 7, 4), (10, 10, 4)])
    assert _lengths(Plain(), (x,), split=split) == (10, 2)
    with pytest.raises(ProfileError, match="n=12 was asked for, but the attention saw 10 tokens"):
        _lengths(Plain(), (x,), n=12, split=split)


def test_lengths_that_cannot_be_read():
    x = torch.zeros(2, 10, WIDTH)
    with pytest.raises(ProfileError) as caught:
        _lengths(Plain(), (x,))  # no attention ran, no n given
    assert str(caught.value) == "no attention ran, so n cannot be read from the inputs; pass n="
    assert _lengths(Plain(), (x,), n=10) == (10, 2)  # n given: taken as it is
    with pytest.raises(ProfileError, match=r"^the attention ran on 0 tokens \(inputs trimmed to nothing\?\)"):
        _lengths(Plain(), (x,), split=Split(lengths=[(0, 0, 4)]))
    with pytest.raises(ProfileError) as caught:  # token ids of 8, but the attention ran on none
        _lengths(tiny_bert(), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, split=Split(lengths=[(0, 0, 2)]))
    assert str(caught.value) == ("n=8 was asked for, but the attention ran on 0 tokens "
                                 "(the model trims its inputs?); check the inputs")


# --- fresh(): a copy of a decode step's inputs whose cache has not run yet ----------------------------------


class Cache:
    """A user's cache: tensors held as attributes and in a list."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.recent = [keys]  # the same tensor reached twice


def test_fresh_gives_new_tensors_every_call():
    x = torch.ones(1, 1, WIDTH)
    cache = Cache(torch.ones(1, 2, 8, 4), torch.ones(1, 2, 8, 4, dtype=torch.float16))
    (first_x, first_cache), first_kwargs = fresh((x, cache), {"scale": 0.5})
    (second_x, second_cache), _ = fresh((x, cache), {"scale": 0.5})
    assert first_kwargs == {"scale": 0.5}
    assert first_cache is not cache and first_cache is not second_cache
    assert first_cache.keys is not second_cache.keys and first_x is not second_x
    assert _is_meta_copy(first_cache.keys, cache.keys) and _is_meta_copy(first_cache.values, cache.values)
    assert _is_meta_copy(first_x, x)
    assert first_cache.recent[0] is first_cache.keys  # one tensor stays one tensor in the copy
    assert cache.keys.device.type == "cpu" and bool((cache.keys == 1).all())  # the user's, left as they were


def test_fresh_on_real_tensors_clones_the_values():
    cache = Cache(torch.arange(4.0), torch.arange(4.0) * 2)
    ((copy,), _) = fresh((cache,), {}, meta=False)
    assert copy.keys is not cache.keys and torch.equal(copy.keys, cache.keys)
    copy.keys.add_(1)  # the forward appends to its cache: the user's must not see it
    assert torch.equal(cache.keys, torch.arange(4.0))


def test_a_decode_step_counts_on_a_fresh_cache_every_time():
    cache = Cache(torch.ones(1, 2, 8, 4), torch.ones(1, 2, 8, 4))
    built = build(Plain(), Request(8, inputs=(torch.ones(1, 1, WIDTH), cache), mode="decode", new_tokens=1))
    assert isinstance(built, Built) and built.decoding and built.given[0][1] is cache
    (_, first), _ = built.call()
    (_, second), _ = built.call()
    assert first is not second and first.keys is not second.keys and first.keys.device.type == "meta"
    (_, real), _ = built.real_call()
    assert real is not cache and real.keys.device.type == "cpu" and torch.equal(real.keys, cache.keys)


# --- cache_bytes: the tensors a cache holds, not the inputs' own ----------------------------------------------


class Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.sliding_window = torch.tensor(4)  # a scalar beside them
        self.extra = torch.zeros(100)  # not keys or values: not the layer's cache


class LayeredCache:
    """As transformers' Cache holds its tensors: a list of layers with keys and values."""

    def __init__(self, layers):
        self.layers = layers


def test_cache_bytes_of_an_object_holding_tensors():
    cache = Cache(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, dtype=torch.float16))
    # keys 2·4·8 floats of 4 bytes = 256, values 2·4·8 halves of 2 bytes = 128; keys reached twice count once
    assert cache_bytes((torch.zeros(2, 1, dtype=torch.long), cache), {}) == 256 + 128
    assert cache_bytes((), {"past_key_values": cache}) == 384


def test_cache_bytes_leaves_out_the_inputs_own_tensors():
    ids = torch.zeros(2, 16, dtype=torch.long)
    assert cache_bytes((ids,), {"position_ids": ids}) == 0
    pair = (torch.zeros(4, 4), torch.zeros(4, 4))
    assert cache_bytes((pair,), {"other": list(pair)}) == 0  # plain containers are arguments, not a cache
    assert cache_bytes((), {"past_key_values": (pair,)}) == 2 * 16 * 4  # but a past_key_values tuple is one
    assert cache_bytes((), {"cache": [pair]}) == 2 * 16 * 4


def test_cache_bytes_of_layers_counts_their_keys_and_values():
    longer = torch.zeros(1, 10, 4)
    layers = [Layer(torch.zeros(1, 6, 4), torch.zeros(1, 6, 4)),
              Layer(longer[:, :3], longer[:, 3:6])]  # a sliding layer's window: views of a longer tensor
    # 6·4 + 6·4 floats, then 3·4 + 3·4 floats (the views as they show), 4 bytes each; no scalars, no extras
    assert cache_bytes((), {"past_key_values": LayeredCache(layers)}) == (24 + 24 + 12 + 12) * 4

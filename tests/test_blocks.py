"""The block finder that compile, checkpointing and FSDP share."""

from torch import nn

from hf_speedup.blocks import block_class_names, find_block_class, find_blocks
from hf_speedup.model_info import describe_model


def test_llama_blocks_found_in_order(tiny_model):
    blocks = find_blocks(tiny_model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 4
    assert blocks == list(tiny_model.model.layers)
    assert find_block_class(tiny_model) is type(tiny_model.model.layers[0])


def test_blocks_found_through_peft_wrapper(tiny_model):
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert find_blocks(wrapped) == list(tiny_model.model.layers)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # a homogeneous list inside a block

    def forward(self, x):
        return self.inner(x)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed: not a block list


def test_homogeneous_module_list_is_the_fallback():
    model = _Plain()
    assert block_class_names(model) == ["_Block"]
    assert find_blocks(model) == list(model.layers)


def test_no_blocks_gives_empty_list():
    assert find_blocks(nn.Linear(2, 2)) == []
    assert find_block_class(nn.Linear(2, 2)) is None


def test_describe_model_counts(tiny_model):
    info = describe_model(tiny_model)
    assert info.block_class == "LlamaDecoderLayer" and info.num_blocks == 4
    assert info.total_parameters == sum(p.numel() for p in tiny_model.parameters())
    assert info.embedding_parameters == tiny_model.model.embed_tokens.weight.numel()
    assert set(info.linear_names) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

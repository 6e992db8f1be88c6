"""Adding a model family is one module and one line (docs/design.md, "Model families"): a module ending with its
``FamilySpec`` (here PhiMoE, a transformers MoE family expertcast does not ship), named in ``FAMILY_MODULES``,
gives its tiny preset, its MoESpec (from the config and from the built model, which agree), its routing capture,
its config keys for ``build-shape --set`` and its checks, with nothing else edited. Every shipped family is built
that way, and a family not listed is refused in one line by every reader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from expertcast.models import families
from expertcast.models.families import (
    FAMILY_MODULES,
    UnsupportedModelError,
    config_keys,
    config_problems,
    registry,
)
from expertcast.models.families.spec import FamilySpec
from expertcast.models.presets import build_tiny, get_config, list_presets
from expertcast.models.routing import RoutingRecorder
from expertcast.models.spec import MoESpec, expert_numel, moe_layer_indices

REPO = Path(__file__).resolve().parents[3]

# The whole new family.
MODULE = '''
from expertcast.models.families.spec import FamilySpec, Preset, tiny_common

SPEC = FamilySpec(
    "phimoe", "PhimoeConfig", experts_key="num_local_experts", expert_intermediate_key="intermediate_size",
    router="softmax",
    presets=(Preset("phimoe-tiny", "phimoe", "tiny", description="PhiMoE debug size: 2 layers, 8 experts, top-2",
                    config=tiny_common(num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
                                       num_experts_per_tok=2)),),
)
'''


@pytest.fixture
def added(tmp_path, monkeypatch):
    (tmp_path / "phimoe_family.py").write_text(MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(families, "FAMILY_MODULES", (*FAMILY_MODULES, "phimoe_family"))  # the one line
    yield
    sys.modules.pop("phimoe_family", None)


def test_a_new_family_is_one_module_and_one_registry_line(added):
    assert list(registry())[-1] == "phimoe" and "phimoe-tiny" in list_presets("tiny")
    model = build_tiny("phimoe-tiny", seed=0)
    spec = MoESpec.from_config(get_config("phimoe-tiny"))
    assert (spec.family, spec.num_layers, spec.num_experts, spec.top_k, spec.num_shared_experts) == ("phimoe", 2, 8,
                                                                                                   2, 0)
    built = MoESpec.from_model(model)  # read from the expert tensors; it refuses a config that disagrees
    assert (built.moe_layers, built.num_experts) == (spec.moe_layers, spec.num_experts) == ([0, 1], 8)
    assert built.expert_bytes == spec.expert_bytes == expert_numel("phimoe", 64, 32) * 4
    with RoutingRecorder(model) as rec, torch.no_grad():
        model(input_ids=torch.randint(4, 500, (1, 6), generator=torch.Generator().manual_seed(0)))
        ids, _, _ = rec.pop()
    assert ids.shape == (6, 2, 2) and int(ids.max()) < 8
    assert {"num_local_experts", "hidden_size"} <= config_keys("phimoe") and "hiden_size" not in config_keys("phimoe")
    assert config_problems(get_config("phimoe-tiny", num_experts_per_tok=9)) == [
        "num_experts_per_tok=9 exceeds the 8 routed experts (num_local_experts)"]


def test_a_family_not_listed_is_one_line_everywhere():
    from transformers import AutoConfig

    config = AutoConfig.for_model("phimoe")
    for read in (moe_layer_indices, MoESpec.from_config, lambda c: expert_numel(c.model_type, 64, 32)):
        with pytest.raises(UnsupportedModelError, match=r"model_type 'phimoe'\)? is not a supported MoE architecture; "
                                                        r"supported families: qwen3_moe \(Qwen3MoeConfig\)") as e:
            read(config)
        assert "\n" not in str(e.value)


def test_every_shipped_family_is_its_own_module_named_once():
    specs = registry()
    assert len(specs) == len(FAMILY_MODULES)
    for module in FAMILY_MODULES:
        mod = sys.modules[module]
        assert isinstance(mod.SPEC, FamilySpec) and specs[mod.SPEC.name] is mod.SPEC
        assert [p.size for p in mod.SPEC.presets].count("tiny") == 1
        rel = Path(*module.split(".")[1:]).with_suffix(".py")
        users = [p.relative_to(REPO) for p in REPO.rglob("*.py")
                 if p.relative_to(REPO).parts[0] not in ("tests", "scripts", ".venv", "build")
                 and p.relative_to(REPO) != rel and f'"{module}"' in p.read_text(encoding="utf-8")]
        assert users == [Path("models/families/__init__.py")], (module, users)

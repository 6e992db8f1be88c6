"""MoE-Beyond per-prompt CSV files as its writer makes them (fixtures: excerpts of that layout): a folder of files,
one sequence each; rows layer by layer from the first MoE layer (1: DeepSeek-V2-Lite's layer 0 is dense); the
token's text, not an id; a position is its row order within its layer."""

from __future__ import annotations

import pytest
from expertcast.commands.traces import main as traces_main
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.data.traces import load_traces


def test_folder_of_prompts(fixtures):
    _, imp = read_traces(fixtures / "moe-beyond", "moe-beyond", ImportOptions(num_experts=64))
    a, b = imp.sequences
    assert (a.seq_id, a.num_tokens, b.seq_id, b.num_tokens) == ("prompt_7_data", 2, "prompt_9_data", 3)
    assert (imp.num_layers, imp.top_k, imp.phase_known, imp.moe_layers) == (2, 6, False, [1, 2])
    assert a.expert_ids.tolist() == [[[8, 26, 56, 57, 60, 11], [3, 35, 38, 62, 63, 60]],
                                     [[8, 15, 21, 26, 44, 56], [0, 8, 17, 33, 50, 24]]]
    assert b.expert_ids[2].tolist() == [[4, 10, 27, 33, 51, 6], [0, 16, 18, 41, 54, 59]]  # the quoted "," token
    assert (b.token_ids == -1).all() and imp.dropped_positions == 0


def test_refusal_names_the_line(fixtures):
    with pytest.raises(ImportFormatError, match=r"prompt_1_data.csv:2: experts must be a list of integers, got 1.5"):
        read_traces(fixtures / "moe-beyond-bad", "moe-beyond", ImportOptions(num_experts=64))


def test_a_file_cut_short_imports_its_complete_positions(fixtures, tmp_path, capsys):
    """The last layer's rows stop after the first token: 1 position has every layer, 2 are dropped and counted."""
    src = fixtures / "moe-beyond-cut" / "prompt_3_data.csv"
    with pytest.warns(UserWarning, match="dropped 2 position"):
        _, imp = read_traces(src, "auto", ImportOptions(num_experts=64))
    (s,) = imp.sequences
    assert s.num_tokens == 1 and imp.num_layers == 3 and (imp.dropped_positions, imp.dropped_sequences) == (2, 0)
    assert traces_main(["import", str(src), "--out", str(tmp_path / "t"), "--num-experts", "64"]) == 0
    assert "dropped 2 position(s) lacking some layers' records (a write cut short)" in capsys.readouterr().out
    meta, seqs = load_traces(tmp_path / "t")
    assert meta.generation["dropped_positions"] == 2 and seqs[0].num_tokens == 1


def test_layers_that_disagree_on_a_token_are_refused(tmp_path):
    f = tmp_path / "prompt_5_data.csv"
    f.write_text('Layer ID,Batch Number,Token,Activated Expert IDs\n1,0,a,"[1, 2]"\n1,0,b,"[3, 4]"\n'
                 '2,0,a,"[1, 2]"\n2,0,c,"[3, 4]"\n', encoding="utf-8")
    with pytest.raises(ImportFormatError, match=r"prompt_5_data.csv:5: position 1 of layer 2 is token 'c', but"):
        read_traces(f, "moe-beyond", ImportOptions(num_experts=8))

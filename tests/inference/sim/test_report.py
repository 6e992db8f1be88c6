"""The hit-vs-capacity plot: every policy its own colour (11 policies, 11 colours), no machine paths in titles."""

from __future__ import annotations


def test_eleven_policies_get_eleven_colours(tmp_path, monkeypatch):
    import expertcast.utils.io as io_mod
    from expertcast.inference.sim.report import plot_hit_vs_capacity

    figs = []
    real = io_mod.save_figure
    monkeypatch.setattr(io_mod, "save_figure", lambda fig, path, dpi=120: (figs.append(fig), real(fig, path, dpi)))
    recs = [{"policy": f"p{i}", "capacity": c, "hit": 0.1 * (i % 5) + c / 2, "pool": "per-layer", "belady_hit": None}
            for i in range(11) for c in (0.25, 0.5)]
    plot_hit_vs_capacity(recs, tmp_path / "p.png")
    [fig] = figs
    colours = [tuple(line.get_color()) for line in fig.axes[0].get_lines()]
    assert len(colours) == 11 and len(set(colours)) == 11
    assert (tmp_path / "p.png").is_file()


def test_series_colors_never_repeat():
    from expertcast.utils.io import series_colors

    for n in (1, 10, 11, 20, 21, 40):
        assert len(set(series_colors(n))) == n

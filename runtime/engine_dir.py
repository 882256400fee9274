"""What a directory handed to the runtime holds when it is not an engine, as advice the user can follow. No torch:
the weight store's command imports this."""

from __future__ import annotations

from pathlib import Path

CONVERTED_FORMAT = "k3-converted/"  # the prefix of `k3build convert`'s config.json "format"


def not_an_engine(cfg: object, path: Path) -> str | None:
    """None when config.json at `path` (already parsed) is an engine's; else the error to raise."""
    where = path.parent
    if isinstance(cfg, dict) and "version" in cfg and "build_config" in cfg:
        return None
    if isinstance(cfg, dict) and str(cfg.get("format", "")).startswith(CONVERTED_FORMAT):
        return (f"{where}: a converted checkpoint, not an engine; build one from it with "
                f"`k3build build {where} ENGINE_DIR`")
    if isinstance(cfg, dict) and ("model_type" in cfg or "architectures" in cfg):
        return (f"{where}: a Hugging Face checkpoint, not an engine; run `k3build convert` on it, then "
                "`k3build build` on the result")
    return f"{path}: not an engine's config (no 'version' and 'build_config'); build an engine with `k3build build`"


def no_config(engine_dir: str | Path) -> str:
    """The error for a path holding no config.json: a file given for its directory, or no engine there."""
    if Path(engine_dir).is_file():
        return (f"{engine_dir}: a file; give the engine's directory (the one `k3build build` wrote, which holds "
                "config.json)")
    return f"{engine_dir}: not an engine dir (no config.json); build one with `k3build build`"

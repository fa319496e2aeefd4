"""Publishing a merged folder to the Hugging Face Hub: access checks, the model card and the upload call."""

from __future__ import annotations

import logging
import os

from ..errors import HubUploadError, InputError, MissingDependencyError
from ..model.walk import unwrap
from ..version import __version__

log = logging.getLogger(__name__)

#: above this many bytes the folder is sent with huggingface_hub's resumable large-folder upload
LARGE_FOLDER_BYTES = 20 * 10**9


def _hf_api(token: str | None):
    try:
        from huggingface_hub import HfApi
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise MissingDependencyError("pushing needs huggingface_hub: pip install huggingface_hub") from e
    return HfApi(token=token)


def _masked(e: BaseException, token: str | None) -> str:
    text = f"{type(e).__name__}: {e}"
    return text.replace(token, "***") if token else text


#: exception class names of the HTTP libraries huggingface_hub uses (httpx, requests, urllib3) that mean the server
#: was not reached at all
_NETWORK_ERRORS = {
    "ConnectError",
    "ConnectTimeout",
    "ConnectionError",
    "NewConnectionError",
    "MaxRetryError",
    "NameResolutionError",
    "ProxyError",
    "ReadTimeout",
    "Timeout",
    "TimeoutException",
}


def unreachable(error: BaseException) -> bool:
    """Whether an error of a Hub call means the server could not be reached (refused, unresolved, timed out).

    Args:
        error: the exception a ``huggingface_hub`` call raised; its causes are searched too.

    Returns:
        True for a network failure, False for an answer of the server (a refused token, a bad name).

    Example:
        >>> unreachable(ConnectionRefusedError(111, "Connection refused")), unreachable(ValueError("401"))
        (True, False)
    """
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError)) or any(
            c.__name__ in _NETWORK_ERRORS for c in type(e).__mro__
        ):
            return True
        todo += [e.__cause__, e.__context__]
    return False


def prepare_repo(repo_id: str, *, token: str | None = None, private: bool | None = None) -> str:
    """Check that the Hub can be reached and the repository created or written, before any merge work.

    Creates the repository when it does not exist (``exist_ok``), which proves the token may write to the
    namespace. A bare name (``"my-model"``) goes to the token owner's namespace, as in huggingface_hub.

    Args:
        repo_id: ``"user/name"`` or a bare ``"name"``.
        token: a Hub token; None uses the locally saved one.
        private: create the repository private (an existing repository keeps its visibility).

    Returns:
        The full repository id, ``"user/name"``.

    Raises:
        InputError: offline mode (``HF_HUB_OFFLINE``) is on, or ``repo_id`` is not a repository name.
        HubUploadError: the Hub cannot be reached or refuses the repository (the token is masked).
    """
    import huggingface_hub.constants as hc

    problems = []
    if (
        not isinstance(repo_id, str)
        or not repo_id.strip("/")
        or repo_id.strip("/").count("/") > 1
        or os.path.isabs(repo_id)
        or repo_id.startswith((".", "~"))
    ):
        problems.append(f"repo_id must be 'name' or 'user/name', got {repo_id!r}")
    if hc.HF_HUB_OFFLINE:
        problems.append(
            "the Hub cannot be reached in offline mode (HF_HUB_OFFLINE=1); unset HF_HUB_OFFLINE to push, "
            "or save locally with save_pretrained_merged(model, 'folder') and upload later with "
            "`hf upload`"
        )
    if problems:
        raise InputError(problems)
    api = _hf_api(token)
    try:
        url = api.create_repo(repo_id.strip("/"), private=private, exist_ok=True, repo_type="model")
    except Exception as e:  # any failure is reported, without the token, before merging
        if unreachable(e):
            raise HubUploadError(
                f"the Hub at {api.endpoint} could not be reached ({_masked(e, token)}): a network "
                "problem, not the token; nothing was merged. Check the connection, a proxy, or "
                "HF_ENDPOINT, then push again"
            ) from None
        raise HubUploadError(
            f"cannot create or write the Hub repository {repo_id!r} at {api.endpoint} "
            f"({_masked(e, token)}); nothing was merged. Check the token (`hf auth login`) and "
            "the repository name"
        ) from None
    return getattr(url, "repo_id", None) or repo_id.strip("/")


def _summarise_targets(targets) -> str:
    """``q_proj, v_proj`` from a target list; layer paths are cut to their last name, each named once."""
    if targets is None:
        return ""
    if isinstance(targets, str):
        return targets if len(targets) <= 80 else targets[:77] + "..."
    names = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    return ", ".join(names[:12]) + (f", ... ({len(names)} names)" if len(names) > 12 else "")


def _hub_id(name: str | None) -> str | None:
    """``name`` when it looks like a Hub id (``org/name``), never a local path."""
    if not name or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1 or os.path.exists(name):
        return None
    return name


def model_card(
    *, repo_id: str, base_model: str | None, adapter: str | None = None, settings: dict, tags=None, target_modules=None
) -> str:
    """A README.md for a merged model, built with huggingface_hub's ``ModelCard``/``ModelCardData``.

    The metadata carries ``base_model`` (only when it is a Hub id: a local path is never written),
    ``base_model_relation: finetune`` (a LoRA merged into its base is a fine-tune of that base; the Hub
    keeps ``merge`` for several models merged together and ``adapter`` for adapter-only repositories),
    ``library_name: transformers`` and tags. The body lists the merge settings and the target module names
    once each, not every layer path.

    Args:
        repo_id: the target repository.
        base_model: the base model's Hub id (or a local path, which is left out).
        adapter: a short description of the adapter (its PEFT type).
        settings: merge settings to list (dtype, base precision, shards, ...).
        tags: extra tags.
        target_modules: the adapter's target modules (a list or PEFT's regex string), summarised.

    Returns:
        The Markdown text with YAML front matter.

    Example:
        >>> print(model_card(repo_id="me/m", base_model="org/base", settings={"dtype": "bfloat16"}))
        ... # doctest: +ELLIPSIS
        ---
        base_model: org/base
        library_name: transformers
        ...
        base_model_relation: finetune
        ---
        ...
    """
    from huggingface_hub import ModelCard, ModelCardData

    hub_base = _hub_id(base_model)
    data = ModelCardData(
        base_model=hub_base,
        library_name="transformers",
        tags=["peft-shardmerge", "merged-lora", *[t for t in (tags or []) if t]],
        **({"base_model_relation": "finetune"} if hub_base else {}),
    )
    rows = dict(settings)
    targets = _summarise_targets(target_modules)
    if targets:
        rows["target modules"] = targets
    table = "\n".join(f"| {k} | {v} |" for k, v in rows.items())
    origin = f"[{hub_base}](https://huggingface.co/{hub_base})" if hub_base else "The base model"
    name = repo_id.split("/")[-1]
    body = (
        f"\n# {name}\n\n{origin} with a {adapter or 'LoRA'} adapter merged into its weights by "
        f"{project_link()}. It loads with "
        f'`AutoModelForCausalLM.from_pretrained("{repo_id}")`; no PEFT or bitsandbytes is needed.\n\n'
        f"| merge setting | value |\n|---|---|\n{table}\n"
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


def project_link() -> str:
    """peft-shardmerge and its version as a model card names them: linked to the repository the installed package's
    metadata names (``Project-URL``: Repository, Source or Homepage), plain text where it names none.

    Returns:
        Markdown, e.g. ``"peft-shardmerge 0.1.0"``.

    Example:
        >>> project_link().startswith(("peft-shardmerge ", "[peft-shardmerge "))
        True
    """
    from importlib.metadata import PackageNotFoundError, metadata

    text = f"peft-shardmerge {__version__}"
    try:
        urls = metadata("peft-shardmerge").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    named = {label.strip().lower(): url.strip() for label, _, url in (u.partition(",") for u in urls)}
    url = next((named[k] for k in ("repository", "source", "homepage") if named.get(k, "").startswith("https://")), "")
    return f"[{text}]({url})" if url else text


def publish(
    folder: str,
    repo_id: str,
    *,
    base_model: str | None,
    peft_config=None,
    report=None,
    save_method: str = "merged_16bit",
    token: str | None = None,
    private: bool | None = None,
    tags=None,
    commit_message: str = "Upload merged model",
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Write the model card of a merged folder and upload the folder.

    Args:
        folder: the finished folder.
        repo_id: ``"user/name"``.
        base_model: the base's ``_name_or_path`` (written only when it is a Hub id).
        peft_config: the adapter's PEFT config (rank, alpha, target modules), or None.
        report: the merge's :class:`~peft_shardmerge.engine.report.MergeReport`, or None for an adapter-only save.
        save_method: how the folder was saved.
        token: Hub token (never logged).
        private: create the repository private.
        tags: extra tags.
        commit_message: the commit title.
        revision: a branch to push to.
        create_pr: open a pull request.

    Returns:
        The URL of the commit.

    Raises:
        HubUploadError: the upload failed (the token is masked).
    """
    settings = {"save method": save_method, "peft-shardmerge": __version__}
    if report is not None:
        settings.update(
            {
                "dtype": report.dtype,
                "base precision": report.base_precision,
                "LoRA layers merged": f"{report.lora_modules_merged}/{report.lora_modules_total}",
                **({"adapters combined": report.combination} if report.combination else {}),
                "shards": len(report.shards),
                "bytes": report.bytes_written,
            }
        )
    if peft_config is not None:
        settings.update({"r": getattr(peft_config, "r", ""), "lora_alpha": getattr(peft_config, "lora_alpha", "")})
    peft_type = str(getattr(getattr(peft_config, "peft_type", None), "value", "LoRA")).replace("LORA", "LoRA")
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(
            model_card(
                repo_id=repo_id,
                base_model=base_model,
                adapter=peft_type,
                settings=settings,
                tags=tags,
                target_modules=getattr(peft_config, "target_modules", None),
            )
        )
    return upload_folder(
        folder,
        repo_id,
        token=token,
        private=private,
        commit_message=commit_message,
        revision=revision,
        create_pr=create_pr,
    )


def upload_folder(
    folder: str,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload merged model",
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Create the repository if needed and upload ``folder`` to it (large folders resumably).

    The Hub address comes from ``HF_ENDPOINT`` as in huggingface_hub. The token is passed to
    huggingface_hub only; it never appears in logs or error messages.

    Args:
        folder: a finished merged folder.
        repo_id: ``"user/name"``.
        token: a Hub token; None uses the locally saved one.
        private: create the repository private (an existing repository keeps its visibility).
        commit_message: the commit title.
        revision: a branch to push to.
        create_pr: open a pull request instead of pushing to the branch.

    Returns:
        The URL of the commit (or of the repository for a large-folder upload).

    Raises:
        MissingDependencyError: huggingface_hub is not installed.
        HubUploadError: the Hub refused or the connection failed.
    """
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)
    api = _hf_api(token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if size > LARGE_FOLDER_BYTES and not create_pr:
            log.info("uploading %.1f GB with the resumable large-folder upload", size / 1e9)
            api.upload_large_folder(
                repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision, private=private
            )
            return f"{api.endpoint}/{repo_id}"
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
            repo_type="model",
        )
        return str(getattr(info, "commit_url", info))
    except Exception as e:  # any failure is reported without the token
        where = f": the Hub at {api.endpoint} could not be reached (network)" if unreachable(e) else ""
        raise HubUploadError(f"upload to {repo_id} failed{where}: {_masked(e, token)}") from None


def publish_model(
    folder,
    repo_id,
    model,
    report,
    save_method,
    *,
    token,
    private,
    tags,
    commit_message="Upload merged model",
    revision=None,
    create_pr=False,
) -> str:
    """Publish a merged folder: :func:`publish` with the base and adapter the model names."""
    base = getattr(unwrap(model).config, "_name_or_path", None)
    cfg = next(iter((getattr(model, "peft_config", None) or {}).values()), None)
    return publish(
        folder,
        repo_id,
        base_model=base,
        peft_config=cfg,
        report=report,
        save_method=save_method,
        token=token,
        private=private,
        tags=tags,
        commit_message=commit_message,
        revision=revision,
        create_pr=create_pr,
    )

"""Publishing a merged folder to the Hugging Face Hub: the model card and the one network call."""

from __future__ import annotations

import logging
import os

from .errors import MissingDependencyError, ShardMergeError

log = logging.getLogger(__name__)

#: above this many bytes the folder is sent with huggingface_hub's resumable large-folder upload
LARGE_FOLDER_BYTES = 20 * 10**9


class HubUploadError(ShardMergeError, RuntimeError):
    """The upload to the Hub failed; the message never contains the token."""


def model_card(*, repo_id: str, base_model: str | None, adapter: str | None, settings: dict, tags=None) -> str:
    """A README.md for a merged model, with ``base_model`` metadata and the merge settings.

    Args:
        repo_id: the target repository.
        base_model: the base model's Hub id or path (``base_model`` metadata when it looks like a Hub id).
        adapter: where the adapter came from.
        settings: merge settings to list (dtype, base precision, shards, ...).
        tags: extra tags.

    Returns:
        The Markdown text with YAML front matter.

    Raises:
        Nothing.

    Example:
        >>> print(model_card(repo_id="me/m", base_model="org/base", adapter="run-1", settings={"dtype": "bfloat16"}))
        ... # doctest: +ELLIPSIS
        ---
        base_model: org/base
        ...
    """
    hub_like = bool(base_model) and base_model.count("/") == 1 and not base_model.startswith((".", "/", "~"))
    meta = ["---"]
    if hub_like:
        meta.append(f"base_model: {base_model}")
    meta += ["library_name: transformers", "tags:", "- peft-shardmerge", "- merged-lora"]
    meta += [f"- {t}" for t in (tags or [])]
    meta.append("---")
    rows = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
    body = f"""
# {repo_id.split('/')[-1]}

This model is {base_model or 'a base model'} with a LoRA adapter ({adapter or 'in memory'}) merged into its
weights by [peft-shardmerge](https://pypi.org/project/peft-shardmerge/). It loads with
`AutoModelForCausalLM.from_pretrained("{repo_id}")`; no PEFT or bitsandbytes is needed.

| merge setting | value |
|---|---|
{rows}
"""
    return "\n".join(meta) + "\n" + body


def upload_folder(folder: str, repo_id: str, *, token: str | None = None, private: bool | None = None,
                  commit_message: str = "Upload merged model", revision: str | None = None,
                  create_pr: bool = False) -> str:
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

    Example:
        >>> upload_folder("merged", "me/llama-merged", private=True)   # doctest: +SKIP
        'https://huggingface.co/me/llama-merged/commit/…'
    """
    try:
        from huggingface_hub import HfApi
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise MissingDependencyError("pushing needs huggingface_hub: pip install huggingface_hub") from e
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if size > LARGE_FOLDER_BYTES and not create_pr:
            log.info("uploading %.1f GB with the resumable large-folder upload", size / 1e9)
            api.upload_large_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                                    private=private)
            return f"{api.endpoint}/{repo_id}"
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                                 revision=revision, create_pr=create_pr, repo_type="model")
        return str(getattr(info, "commit_url", info))
    except Exception as e:  # noqa: BLE001 - any failure is reported without the token
        text = f"{type(e).__name__}: {e}"
        if token:
            text = text.replace(token, "***")
        raise HubUploadError(f"upload of {folder} to {repo_id} failed: {text}") from None

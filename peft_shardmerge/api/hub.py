"""Publishing a merged folder to the Hugging Face Hub: access checks, the model card and the upload call."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from ..errors import HubUploadError, InputError
from ..model.walk import unwrap
from ..output.hub_push import HubSession, HubTarget, hf_api, masked, push_folder, resolved_token, unreachable
from ..output.hub_staging import staging_folder
from ..version import __version__

log = logging.getLogger(__name__)


@dataclass
class Push:
    """A merge pushed to the Hub: the repository and commit (:class:`~peft_shardmerge.output.hub_push.HubTarget`),
    where its shards wait for their upload, and what its model card says.

    Attributes:
        target: the repository, the token, the branch and the commit's message.
        staging: the folder shards wait in (None: the system's temporary folder, ``tempfile.gettempdir()``).
        in_flight: the most shards on the local disk at once.
        prepare: makes the repository and checks its access, returning its full id: called once the staging folder
            is found big enough, before anything is merged (None: done already).
        replace: delete, in the push's commit, the repository's weight files it does not write (``overwrite``).
        save_method: what the model card says was saved.
        tags: extra model card tags.
        url: the commit's URL, once pushed.

    Example:
        >>> Push(HubTarget("me/tiny")).staging_dir() == tempfile.gettempdir()
        True
    """

    target: HubTarget
    staging: str | None = None
    in_flight: int = 2
    prepare: Callable[[], str] | None = None
    replace: bool = False
    save_method: str = "merged_16bit"
    tags: list[str] = field(default_factory=list)
    url: str | None = None

    def staging_dir(self) -> str:
        """The staging folder."""
        return os.path.abspath(os.fspath(self.staging)) if self.staging else tempfile.gettempdir()

    def folder(self) -> str:
        """The push's own folder in the staging folder (:func:`~peft_shardmerge.output.hub_staging.staging_folder`)."""
        return staging_folder(self.staging_dir(), self.target.repo_id)

    def card_hook(
        self, hook: Callable[[str], None] | None, plan, source, card_base: tuple[str | None, object]
    ) -> Callable[[str], None]:
        """``hook``, then the model card (``README.md``) written into the folder the push commits.

        Args:
            hook: the caller's hook (a tokenizer saved), or None.
            plan: the merge's plan.
            source: what produced its tensors (its report's fields, every tensor written by then, go in the card).
            card_base: the base model's name and the adapter's PEFT config (:meth:`MergeJob.card_base`).

        Returns:
            The hook the executor calls before the merge record is written.
        """

        def write(folder: str) -> None:
            if hook is not None:
                hook(folder)
            base, peft_config = card_base
            fields = source.report_fields()
            settings = merge_settings(
                self.save_method,
                dtype=str(plan.dtype).removeprefix("torch."),
                base_precision=fields.get("base_precision", plan.base_precision),
                merged=(fields.get("lora_modules_merged", plan.layer_count), plan.layer_count),
                combination=fields.get("combination") or None,
                shards=len(plan.shard_names),
                nbytes=plan.total_size,
                peft_config=peft_config,
            )
            write_card(folder, self.target.repo_id, base, peft_config, settings, self.tags)

        return write


def prepare_repo(
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Check that the Hub can be reached and the repository created and written, before any merge work.

    Creates the repository when it does not exist (``exist_ok``), then asks the Hub how it would take a file (its
    ``preupload`` call, which writes nothing and needs the right to write): a read-only token, a repository of
    someone else's or a missing one is refused here, not after the merge. A bare name (``"my-model"``) goes to the
    token owner's namespace, as in huggingface_hub. The token comes from ``token``, else ``HF_TOKEN`` or the login
    cache (``hf auth login``), as huggingface_hub finds it; it is never printed.

    Args:
        repo_id: ``"user/name"`` or a bare ``"name"``.
        token: a Hub token; None uses the locally saved one.
        private: create the repository private (an existing repository keeps its visibility).
        revision: the branch the push goes to (made at the commit where it does not exist yet).
        create_pr: the push opens a pull request (a token that may only open one is enough).

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
            "the Hub cannot be reached in offline mode (HF_HUB_OFFLINE=1); unset HF_HUB_OFFLINE to push, or merge "
            "to a local folder (save_pretrained_merged(model, 'folder'), `peft-shardmerge merge`) and upload it "
            "later with `hf upload`"
        )
    if problems:
        raise InputError(problems)
    api = hf_api(token)
    said = resolved_token(token)  # what the calls send, masked in every message
    try:
        url = api.create_repo(repo_id.strip("/"), private=private, exist_ok=True, repo_type="model")
    except Exception as e:  # any failure is reported, without the token, before merging
        if unreachable(e):
            raise HubUploadError(
                f"the Hub at {api.endpoint} could not be reached ({masked(e, said)}): a network "
                "problem, not the token; nothing was merged. Check the connection, a proxy, or "
                "HF_ENDPOINT, then push again"
            ) from None
        raise HubUploadError(
            f"cannot create or write the Hub repository {repo_id!r} at {api.endpoint} "
            f"({masked(e, said)}); nothing was merged. Check the token (`hf auth login`) and "
            "the repository name"
        ) from None
    full = getattr(url, "repo_id", None) or repo_id.strip("/")
    target = HubTarget(full, token=token, revision=revision, create_pr=create_pr)
    _check_write(target)
    if create_pr and revision and not HubSession(target).branch_exists():
        raise InputError(
            [f"create_pr with revision={revision!r}: a pull request is opened against a branch that exists; create "
             "it first, or leave revision out to open it against main"]
        )  # fmt: skip
    return full


def _check_write(target: HubTarget) -> None:
    """Ask the Hub how it would take a small file (nothing is written): refused without the right to write."""
    from huggingface_hub import CommitOperationAdd

    session = HubSession(target)
    try:
        session.upload_all([CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=b"---\n---\n")])
    except HubUploadError as e:
        status = getattr(getattr(e.__context__, "response", None), "status_code", None)
        if not getattr(e, "refused", True):
            why = "the Hub could not be reached (a network problem, not the token)"
        elif status is not None and status >= 500:
            why = f"the Hub answered with a server error ({status}), not about the token: try again later"
        elif status == 401:
            why = "no valid token was sent: log in with `hf auth login`, set HF_TOKEN, or pass token="
        else:
            why = (
                f"the Hub refuses to take files into {target.repo_id} with this token: use a token with write "
                "access to it (`hf auth login`, HF_TOKEN)"
            )
        raise HubUploadError(f"{why}; nothing was merged ({e})") from None


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


def merge_settings(
    save_method: str,
    *,
    dtype: str | None = None,
    base_precision: str | None = None,
    merged: tuple[int, int] | None = None,
    combination: str | None = None,
    shards: int | None = None,
    nbytes: int | None = None,
    peft_config=None,
) -> dict:
    """The merge settings a model card lists.

    Args:
        save_method: how the model was saved.
        dtype: the dtype (or GGUF types) written.
        base_precision: the base the adapter was merged into.
        merged: LoRA layers merged, of how many.
        combination: how several adapters were combined, if they were.
        shards: files of weights.
        nbytes: their bytes.
        peft_config: the adapter's PEFT config (its rank and alpha are listed), or None.

    Returns:
        ``{setting: value}``, in the card's order.

    Example:
        >>> merge_settings("merged_16bit", dtype="bfloat16", merged=(4, 4))["LoRA layers merged"]
        '4/4'
    """
    settings = {"save method": save_method, "peft-shardmerge": __version__}
    rows = {
        "dtype": dtype,
        "base precision": base_precision,
        "LoRA layers merged": f"{merged[0]}/{merged[1]}" if merged else None,
        "adapters combined": combination,
        "shards": shards,
        "bytes": nbytes,
    }
    settings.update({k: v for k, v in rows.items() if v is not None})
    if peft_config is not None:
        settings.update({"r": getattr(peft_config, "r", ""), "lora_alpha": getattr(peft_config, "lora_alpha", "")})
    return settings


def write_card(folder: str, repo_id: str, base_model: str | None, peft_config, settings: dict, tags=None) -> None:
    """Write the model card (``README.md``) of a merged model into the folder that is pushed (see :func:`model_card`).

    Args:
        folder: the folder.
        repo_id: the repository.
        base_model: the base's name (written only when it is a Hub id).
        peft_config: the adapter's PEFT config, or None.
        settings: :func:`merge_settings`.
        tags: extra tags.
    """
    peft_type = str(getattr(getattr(peft_config, "peft_type", None), "value", None) or "LoRA").replace("LORA", "LoRA")
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


def publish(
    folder: str,
    target: HubTarget,
    *,
    base_model: str | None,
    peft_config=None,
    report=None,
    save_method: str = "merged_16bit",
    tags=None,
    known: dict[str, str] | None = None,
    replace: bool = False,
) -> str:
    """Write the model card of a finished folder and push the folder in one commit (each file uploaded by content
    first: :func:`~peft_shardmerge.output.hub_push.push_folder`).

    Args:
        folder: the finished folder.
        target: the repository and commit.
        base_model: the base's ``_name_or_path`` (written only when it is a Hub id).
        peft_config: the adapter's PEFT config (rank, alpha, target modules), or None.
        report: the merge's :class:`~peft_shardmerge.engine.report.MergeReport`, or None for an adapter-only save.
        save_method: how the folder was saved.
        tags: extra tags.
        known: SHA-256 of files already hashed, by relative path (not read again to hash them).
        replace: delete, in the same commit, the repository's weight files the folder does not hold.

    Returns:
        The URL of the commit.

    Raises:
        HubUploadError: an upload or the commit failed (the token is masked); nothing was committed.
    """
    settings = merge_settings(save_method, peft_config=peft_config)
    if report is not None:
        settings = merge_settings(
            save_method,
            dtype=report.dtype,
            base_precision=report.base_precision,
            merged=(report.lora_modules_merged, report.lora_modules_total),
            combination=report.combination or None,
            shards=len(report.shards),
            nbytes=report.bytes_written,
            peft_config=peft_config,
        )
    write_card(folder, target.repo_id, base_model, peft_config, settings, tags)
    return push_folder(folder, target, known, replace)


def model_names(model) -> tuple[str | None, object]:
    """The base a loaded PeftModel was loaded from (``_name_or_path``) and its first adapter's PEFT config, for a
    model card."""
    base = getattr(unwrap(model).config, "_name_or_path", None)
    return base, next(iter((getattr(model, "peft_config", None) or {}).values()), None)


def publish_model(folder, target: HubTarget, model, report, save_method, *, tags, known=None, replace=False) -> str:
    """Publish a merged folder: :func:`publish` with the base and adapter the model names."""
    base, cfg = model_names(model)
    return publish(
        folder,
        target,
        base_model=base,
        peft_config=cfg,
        report=report,
        save_method=save_method,
        tags=tags,
        known=known,
        replace=replace,
    )


def push_gguf_folder(folder: str, push: Push, report, base_model: str | None, peft_config) -> str:
    """Push the GGUF files a merge wrote into a push's staging folder, with their records, a model card and a
    Modelfile, in one commit.

    Args:
        folder: the folder of the files this run wrote (in :func:`~peft_shardmerge.output.hub_staging.staged_push`).
        push: where to.
        report: the merge's report.
        base_model: the base's name (written in the card when it is a Hub id).
        peft_config: the adapter's PEFT config, or None.

    Returns:
        The commit's URL.
    """
    import json

    known, ggufs = {}, sorted(f for f in os.listdir(folder) if f.lower().endswith(".gguf"))
    for name in os.listdir(folder):
        if name.endswith(".merge_manifest.json"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                known.update({k: v["sha256"] for k, v in json.load(f).get("files", {}).items()})
    if ggufs and not os.path.exists(os.path.join(folder, "Modelfile")):  # ollama create NAME -f Modelfile
        with open(os.path.join(folder, "Modelfile"), "w", encoding="utf-8") as f:
            f.write(f"FROM ./{ggufs[0]}\n")
    url = publish(
        folder,
        push.target,
        base_model=base_model,
        peft_config=peft_config,
        report=report,
        save_method=push.save_method,
        tags=push.tags,
        known=known,
        replace=push.replace,
    )
    return url

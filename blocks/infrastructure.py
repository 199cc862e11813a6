"""Prefect blocks for the infrastructure a recipe runs on; secrets are `SecretStr`.

Recipes hold hyper-parameters and are safe to share; blocks hold servers, buckets and
credentials and live in the Prefect server. Each block turns into plain settings
(`settings()`) before the core sees it, so the core never imports Prefect.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from draftflow.recipe.schema import VLLMLaunchSection, VLLMSection


def with_credentials(
    options: dict[str, Any], key_id: SecretStr | None, secret: SecretStr | None
) -> dict[str, Any]:
    """fsspec options plus the object-store credentials (s3fs names: key, secret)."""
    options = dict(options)
    if key_id:
        options["key"] = key_id.get_secret_value()
    if secret:
        options["secret"] = secret.get_secret_value()
    return options


class VLLMServer(Block):
    """vLLM endpoint(s) for extraction, regeneration and evaluation, and how to start one."""

    _block_type_name = "draftflow vLLM server"
    _block_type_slug = "draftflow-vllm-server"

    endpoints: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="Base URLs; shards are spread over all of them (data-parallel extraction).",
    )
    api_key: SecretStr | None = Field(None, description="vLLM --api-key, sent as a Bearer token.")
    launch: dict[str, Any] | None = Field(
        None,
        description="Launch settings when no server answers (python, device, max_model_len, "
        "staging_dir, extra_args, env, startup_timeout_s) — the recipe's vllm.launch shape.",
    )

    def settings(self) -> VLLMSection:
        launch = VLLMLaunchSection.model_validate(self.launch) if self.launch is not None else None
        return VLLMSection(endpoints=self.endpoints, launch=launch)

    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None


class HiddenStateStore(Block):
    """Where hidden-state shards live: any fsspec URL, with its options and credentials."""

    _block_type_name = "draftflow hidden-state store"
    _block_type_slug = "draftflow-hidden-state-store"

    url: str = Field(description="fsspec URL: /local/path, /dev/shm/…, s3://bucket/prefix.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options, e.g. client_kwargs.endpoint_url."
    )
    access_key_id: SecretStr | None = Field(None, description="Object-store key id (S3: key).")
    secret_access_key: SecretStr | None = Field(None, description="Object-store secret (S3: secret).")

    def settings(self) -> tuple[str, dict[str, Any]]:
        return self.url, with_credentials(self.storage_options, self.access_key_id, self.secret_access_key)


class CheckpointDestination(Block):
    """Where finished checkpoints are published: an fsspec URL or a Hugging Face Hub repo."""

    _block_type_name = "draftflow checkpoint destination"
    _block_type_slug = "draftflow-checkpoint-destination"

    url: str | None = Field(None, description="fsspec URL of a folder; one sub-folder per checkpoint.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (shown in the UI: put credentials below)."
    )
    access_key_id: SecretStr | None = Field(None, description="Object-store key id of `url` (S3: key).")
    secret_access_key: SecretStr | None = Field(
        None, description="Object-store secret of `url` (S3: secret)."
    )
    hf_repo_id: str | None = Field(None, description="Hub repo id (owner/name) instead of a URL.")
    hf_token: SecretStr | None = Field(None, description="Hub token with write access.")
    hf_private: bool = Field(
        True, description="Create the Hub repo private (an existing repo keeps its visibility)."
    )

    def settings(self) -> dict[str, Any]:
        if bool(self.url) == bool(self.hf_repo_id):
            raise ValueError("set exactly one of `url` and `hf_repo_id`")
        return {
            "url": self.url,
            "storage_options": with_credentials(
                self.storage_options, self.access_key_id, self.secret_access_key
            ),
            "hf_repo_id": self.hf_repo_id,
            "hf_token": self.hf_token.get_secret_value() if self.hf_token else None,
        }

    def destination(self):
        """The core's :class:`~draftflow.publish.Destination`, secrets included (never a task parameter)."""
        from draftflow.publish import Destination  # pulls torch (contract check): not at block import

        s = self.settings()
        if s["hf_repo_id"]:
            return Destination(f"hf://{s['hf_repo_id']}", hf_token=s["hf_token"], private=self.hf_private)
        return Destination.parse(
            s["url"], storage_options=s["storage_options"], hf_token=s["hf_token"], private=self.hf_private
        )


ALL_BLOCKS = (VLLMServer, HiddenStateStore, CheckpointDestination)


def register_all() -> list[str]:
    """Register the block types with the Prefect server (what `draftflow blocks register` does)."""
    for block in ALL_BLOCKS:
        block.register_type_and_schema()
    return [b._block_type_slug for b in ALL_BLOCKS]

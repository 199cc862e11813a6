"""Prefect blocks: infrastructure settings (servers, stores, destinations) with secrets as SecretStr."""

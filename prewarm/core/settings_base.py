"""The base of every settings group: where a group reads its values from, and what no group accepts.

Its own module so that the groups too large for `settings.py` (`planner_settings.py`,
`engine_settings.py`) build on it without importing the settings root.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class _Group(BaseSettings):
    """A settings group: environment first, then the config file, then defaults. No group accepts
    NaN or infinity for a number (an infinite timeout is a hang, not a setting)."""

    group: ClassVar[str] = ""
    model_config = SettingsConfigDict(allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)

"""The plugin tests' fixtures (fake distributions, a clean plugin state) serve the kit's tests too."""

from tests.plugins.conftest import FakeSite, clean_plugin_state, fake_site  # noqa: F401

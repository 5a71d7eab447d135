"""Packages of the qkscope distribution (metadata lives in pyproject.toml).

The Alembic migrations stay in the repository's top-level `migrations/` directory and are
shipped in the wheel as the package `qkscope_migrations` (a non-generic import name), so
an installed qkscope (not editable) can migrate its database: service/store/migrate.py finds
them through importlib.resources.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["service*", "workers*", "qkscope*"]),
        "qkscope_migrations",
        "qkscope_migrations.versions",
    ],
    package_dir={"qkscope_migrations": "migrations"},
    package_data={
        # The web UI's static files (index.html, js/, the vendored ECharts and its license).
        "service": ["py.typed"],
        "service.ui": ["static/*.html", "static/*.css", "static/js/*.js", "static/vendor/*"],
        "workers": ["py.typed"],
        "qkscope": ["py.typed"],  # the researcher's client package, where it exists
        "qkscope_migrations": ["script.py.mako"],
    },
)

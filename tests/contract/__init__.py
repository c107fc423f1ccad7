"""Contract tests: the stand-ins held to the real parts they replace.

Each module runs the same tests on a stand-in from standins and on the real
thing (fetched by scripts/setup-real-parts; skipped with its reason where that
cannot run, failed instead under GPUSHARE_REQUIRE_REAL_PARTS=1).
"""

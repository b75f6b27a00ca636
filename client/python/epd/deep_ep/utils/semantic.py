# SPDX-License-Identifier: MIT
"""Small helpers DeepEP V2's code and tests import."""
import functools
import weakref


def value_or(value, default):
    """value, or default where value is None."""
    return default if value is None else value


def weak_lru(maxsize=128, typed=False):
    """functools.lru_cache for methods, holding the instance weakly (a
    cache keyed by self would keep every instance alive)."""
    def wrap(func):
        @functools.lru_cache(maxsize, typed)
        def cached(ref, *args, **kwargs):
            return func(ref(), *args, **kwargs)

        @functools.wraps(func)
        def method(self, *args, **kwargs):
            return cached(weakref.ref(self), *args, **kwargs)
        return method
    return wrap

"""The version of peft-shardmerge, in a module of its own so that library modules can read it without importing the
package root."""

__version__ = "0.1.0"

"""The key/value cache: the page pool, each row's pages, the image-state cache, how many rows fit."""

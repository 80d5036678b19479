"""aiak.data — input pipeline helpers.

Will hold a GPU data prefetcher that copies the next batch on a side stream while the current
step computes, and balanced distributed samplers. Nothing is implemented yet.
"""

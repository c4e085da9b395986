"""What happened and what it cost: records, stats, the report, measurements, and the stall watch.

- `records`: one JSON line per save and per migration hop, beside the checkpoints.
- `stats`: a summary and a monthly bill from the records; `report`: a chart and a page of them.
- `probe`: the measurements behind the codec policy (tier bandwidth, codec rates on samples).
- `watch`: a save that stands still logs every engine thread's stack, once.
"""

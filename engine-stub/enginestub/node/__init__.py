"""Node emulation: emulated NPU servers for a control plane that has no kubelet (SYSTEM.md §5).

The node emulator plays three node-side parts, the way KWOK fakes nodes but with real processes:

- the **kubelet**: registers Nodes, keeps them Ready (status + Lease), runs the pods bound to them
  as local processes on their own loopback IPs, probes readiness, restarts with back-off, stops
  them with the grace period;
- the **Ascend device plugin**: advertises ``huawei.com/Ascend910`` (one unit per NPU, two dies
  each, CloudMatrix-Infer §3) and hands each pod the specific NPUs it was granted;
- the **fault-detection container** (P/D-Serve §3.4, Fig. 8): a per-node device status file,
  readable by every pod on the node, that tests flip to inject faults.

Pure parts: :mod:`.topology`, :mod:`.allocator`, :mod:`.devicestatus`, :mod:`.nodestatus`,
:mod:`.podspec`, :mod:`.podstatus`. I/O: :mod:`.runner` (processes), :mod:`.control` (fault
API), and the emulator itself, one concern a module: :mod:`.emulator` (composes the parts, starts and stops them),
:mod:`.state` (config, node and pod records), :mod:`.nodelifecycle` (Nodes, status, taints, Leases),
:mod:`.podlifecycle` (pods from admission to deletion), :mod:`.podenv` (what a pod gets from its
node), :mod:`.faults` (device status file, node-down), :mod:`.events` (Events). Its command line,
for the programs that start one: :mod:`.command`.
"""

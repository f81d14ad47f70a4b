"""The guest's network identity: fixed when the parent boots, so every child of a snapshot has it.

Children are copies of one RAM image, so they cannot differ here; the host tells them apart by the
namespace each child's NIC is plugged into (see docs/networking.md). Stdlib only: PID 1 imports it.
"""

INTERFACE = "eth0"
GUEST_ADDRESS = "172.29.255.2"
#: The tap in the child's namespace answers here; it also relays DNS to the host's resolver.
GATEWAY = "172.29.255.1"
PREFIX_LEN = 30
NETMASK = "255.255.255.252"
GUEST_MAC = "52:54:00:fd:00:02"
NAMESERVER = GATEWAY

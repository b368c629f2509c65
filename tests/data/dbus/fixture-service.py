#!/usr/bin/python3
"""A stand-in D-Bus service for tests/it/private_bus.rs (Debian's python3-gi).

usage: fixture-service.py BUS_ADDRESS

Connects to BUS_ADDRESS, exports /org/corral/ItFixture1 with the interface
org.corral.ItFixture1.Admin (method Ping -> "pong"), requests the name
org.corral.ItFixture1 without queueing, prints "owned" and serves until killed.
Exits 3 when the bus refuses the name.
"""
import sys

from gi.repository import Gio, GLib

NAME = "org.corral.ItFixture1"
PATH = "/org/corral/ItFixture1"
XML = """
<node>
  <interface name="org.corral.ItFixture1.Admin">
    <method name="Ping"><arg name="reply" type="s" direction="out"/></method>
  </interface>
</node>
"""


def on_call(_conn, _sender, _path, _iface, method, _params, invocation):
    if method == "Ping":
        invocation.return_value(GLib.Variant("(s)", ("pong",)))
    else:
        invocation.return_dbus_error("org.freedesktop.DBus.Error.UnknownMethod", method)


def main():
    flags = Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
    conn = Gio.DBusConnection.new_for_address_sync(sys.argv[1], flags, None, None)
    iface = Gio.DBusNodeInfo.new_for_xml(XML).interfaces[0]
    conn.register_object(PATH, iface, on_call, None, None)
    try:
        reply = conn.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                               "RequestName", GLib.Variant("(su)", (NAME, 4)),  # 4: do not queue
                               GLib.VariantType("(u)"), Gio.DBusCallFlags.NONE, 10000, None)
    except GLib.Error as e:
        print("RequestName refused:", e.message, file=sys.stderr, flush=True)
        sys.exit(3)
    if reply.unpack()[0] != 1:  # 1: primary owner
        print("RequestName answered", reply.unpack()[0], file=sys.stderr, flush=True)
        sys.exit(3)
    print("owned", flush=True)
    GLib.MainLoop().run()


if __name__ == "__main__":
    main()

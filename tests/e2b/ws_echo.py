"""A WebSocket echo server in the standard library only (the guest image has no WebSocket package):
``python3 ws_echo.py PORT``. Text and binary messages of up to 64 KiB are sent back as they came."""

import base64
import hashlib
import socket
import struct
import sys
import threading

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def read_exactly(conn, n):
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def serve(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        part = conn.recv(4096)
        if not part:
            return
        head += part
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    while True:
        first, second = read_exactly(conn, 2)
        opcode, length = first & 0x0F, second & 0x7F
        if length == 126:
            length = struct.unpack("!H", read_exactly(conn, 2))[0]
        elif length == 127:
            length = struct.unpack("!Q", read_exactly(conn, 8))[0]
        if length > 65536:
            return
        mask = read_exactly(conn, 4)
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(read_exactly(conn, length)))
        if opcode == 8:  # close: answer it and end
            conn.sendall(b"\x88" + bytes([len(payload)]) + payload)
            return
        if opcode in (1, 2):
            size = bytes([length]) if length < 126 else b"\x7e" + struct.pack("!H", length)
            conn.sendall(bytes([0x80 | opcode]) + size + payload)


def main():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", int(sys.argv[1])))
    listener.listen(8)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=lambda c=conn: (serve_quietly(c)), daemon=True).start()


def serve_quietly(conn):
    try:
        serve(conn)
    except (EOFError, OSError, StopIteration):
        pass
    finally:
        conn.close()


if __name__ == "__main__":
    main()
